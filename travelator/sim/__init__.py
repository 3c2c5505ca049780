"""Capacity planning: the engine's own scheduler and block manager driven by a simulated clock
and a step-cost model in place of the model runner (``travelator simulate``)."""
