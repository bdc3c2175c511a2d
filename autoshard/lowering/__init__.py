"""From a captured ``torch.fx`` graph to the weighted DAG the splitter works on.

``from_fx.build_dag`` builds the DAG; ``inplace`` and ``randomness`` add the ordering edges that
in-place writes and random draws impose beyond data flow; ``shape_carriers`` lets a read of a
tensor's shape cross a boundary without the tensor. These modules import torch, so they
live here, between capture and the pure graph algorithms of ``autoshard.graph``.
"""
