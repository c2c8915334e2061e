"""What is trained and how: config, model, optimizer, schedules, checkpoints, monitoring, train loop."""
