"""RLHF stage apps (SFT, reward, PPO), data formats, models, PPO math and metrics."""
