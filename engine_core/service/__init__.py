"""The engine process: its startup, the step loop server, rank recovery, and the client socket."""
