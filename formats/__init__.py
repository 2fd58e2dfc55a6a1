"""Reading and writing model files, and resolving model references to local paths."""
