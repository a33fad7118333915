"""rl: the RL stage's library: the Rollout and its generation and scoring (rollout.py), reward sources
(rewards.py), the four models (models.py), experience (experience.py), the update (update.py), step
metrics (metrics.py) and reward-hacking alarms (alarms.py). Imports evaluation/ and below."""
