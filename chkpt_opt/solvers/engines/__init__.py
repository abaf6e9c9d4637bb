"""Engines: an interval program in, an outcome out (CP-SAT, MILP, LP). Nothing here is a
registered solver; the front-ends (``cpsat``, ``milp``, ``lp_round``, ``pruned``) prepare a
graph, warm-start and call them, and the plumbing judges what they return."""
