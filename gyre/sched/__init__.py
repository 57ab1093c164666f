"""gyre.sched"""
