"""The loop and what keeps it alive: seeding, resuming, checkpoint state, the trainer's update parts."""
