"""gyre.traj"""
