"""Planner: predicts step time, memory and cost of a layout before launch (pure, no torch)."""
