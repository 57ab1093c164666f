"""gyre.report"""
