"""conformance/checks"""
