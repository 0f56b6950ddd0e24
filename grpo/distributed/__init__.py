"""The ranks of one launch: roles and process groups, collectives, faults and start-up checks, and
the trainer → generator weight sync."""
