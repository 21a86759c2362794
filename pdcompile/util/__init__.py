"""Small helpers for messages: "did you mean" suggestions (suggest) and a user's own code
imported by path, `file.py:function`, with one-line errors (user_code)."""
