"""Files the engine reads and writes, checked before anything is allocated.

- `files.py`: bounded reads and JSON parsing of files a user may have received from someone else.
- `atomic_dir.py`: crash-safe replacement of an output directory that keeps a user's own files.
- `inputs.py`: prompts, token-id files and images given on the command line or through the API.
"""
