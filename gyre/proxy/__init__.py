"""gyre.proxy"""
