"""The continual loop, evaluation, checkpoint/resume and the run directory."""
