"""gyre.engine"""
