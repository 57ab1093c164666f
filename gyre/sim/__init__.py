"""gyre.sim"""
