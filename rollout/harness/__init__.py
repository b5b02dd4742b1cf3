"""Agent harnesses: the first messages of a task and what each action leads to."""
