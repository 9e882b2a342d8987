"""`kvbank loadgen`: several agents' conversations against one server, measured per turn.

Data flows scenarios.py (seeded scripts, the conversation history) -> targets.py (one turn to
a gRPC or OpenAI server, timed) -> run.py (the schedule, one row per turn, token accounting)
-> report.py (summary, tables, JSON, plot); cli.py wires the command. apps/bench/compare.py
(`kvbank bench compare`) runs one scenario against kvbank and mlx_lm.server; it uses this
package, never the other way round.
"""
