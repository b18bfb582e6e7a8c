"""Weight sync: the actor's weights to the engines after each update. What is sent (sources: the actor's
parameters by FSDP unit, or LoRA-merged weights), what both sides agree on (wire: format, checksums), the two
mechanisms (colocated: each rank writes its own gathers into its engine; broadcast: the actor's first rank sends
byte buckets to the engines' ranks, with the sender's chunk order and staging buffers in buckets), and the choice
between them (sync). It reads the actor through the strategies' full-parameter view (rlrun.strategies.blocks) and
hands the engines what their receivers take (rlrun.engines.receivers), so it sits above both.

May import strategies/ (blocks), engines/ (protocol, receivers), launch/ (the transfer and its bounded waits),
models/ and runtime/.
"""
