"""Reading and writing checkpoint files with torch: torch zip/legacy files, safetensors through the
library, what may be saved.
"""
