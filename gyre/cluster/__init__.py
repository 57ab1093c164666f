"""gyre.cluster"""
