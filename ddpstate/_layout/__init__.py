"""Byte layouts, torch-free: zip records, the safetensors header, the everyday types' global names.
Shared by readers and writers.
"""
