"""The torch-free streaming engine behind ``ddpstate convert``: scan, rewrite and re-emit a
checkpoint's pickle, read and write zip archives and safetensors files, one tensor at a time.
"""
