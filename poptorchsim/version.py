"""poptorchsim's version, in a module of its own so that the runtime (the
executable cache, exported executables) can name it without importing the
package's face."""
__version__ = "0.1.0"
