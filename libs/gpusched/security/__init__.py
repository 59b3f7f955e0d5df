"""Trust: who may connect, publish and append what, and how an appended fact proves its writer."""
