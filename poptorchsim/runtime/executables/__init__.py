"""runtime/executables/: compiled programs kept on disk: the executable cache
and exported executables."""
