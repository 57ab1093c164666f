"""gyre.train"""
