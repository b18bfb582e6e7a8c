"""Weight sync: the actor's weights to the engines after each update. The bucket plan and the interface an engine
takes a sync through (buckets), the actor's parameters in blocks each gathered in one collective (blocks), and the
sync itself with its parameter sources, LoRA-merged ones included (sync).

May import launch/ (the transfer and its bounded waits), models/ and runtime/.
"""
