"""runtime/settings/: the user's options resolved: CompileConfig and PopTorch's
option parsers."""
