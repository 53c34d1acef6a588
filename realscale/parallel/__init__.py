"""Parallel layout: process groups, device meshes, strategies, resharding.

Model code never knows ranks; everything about who-holds-what lives here.
"""
