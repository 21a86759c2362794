"""pdcompile's tests, one folder per room of the package; shared builders in helpers/."""
