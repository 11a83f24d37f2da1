"""Capture: the joint forward+backward graph and its cut into per-region segments."""
