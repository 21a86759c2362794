"""Small helpers: "did you mean" suggestions (suggest), a user's own code imported by path,
`file.py:function`, with one-line errors (user_code), a Python file run as a module
(module_file), dotted attribute paths (attr_path), and a user's file read only where it is a
plain file of bounded size (bounded_file)."""
