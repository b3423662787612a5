"""impls"""
