"""The plan IR and (later) the compiler passes. Pure: never imports the runtime."""
