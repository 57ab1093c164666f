"""gyre.harness"""
