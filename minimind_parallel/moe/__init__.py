"""MiniMind's mixture-of-experts feed-forward (`use_moe=True` in jingyaogong/minimind's
model/model_minimind.py, `MOEFeedForward`), computed as grouped GEMMs over tokens sorted by expert.

    router.py       the gate Linear's scores -> top-k experts and weights (`route`)
    aux_loss.py     the per-expert statistics of a batch and the load-balancing loss they give
    experts.py      the local experts (MiniMind's `experts.{e}.{gate,up,down}_proj`) as one GEMM each
    dispatcher.py   how the sorted tokens reach the ranks holding their experts (here: in place)
    feed_forward.py `MOEFeedForward`: route -> sort -> dispatch -> experts -> combine -> weighted sum
    routing_record.py each microbatch's tokens per expert over a step (`recorded_routing`)
"""
from .aux_loss import RouterStats, load_balancing_loss, local_stats, summed_over
from .dispatcher import LocalDispatcher
from .experts import Expert, GroupedExperts
from .feed_forward import MOEFeedForward, routing_histogram
from .router import Routing, route
from .routing_record import recorded_routing

__all__ = ["Expert", "GroupedExperts", "LocalDispatcher", "MOEFeedForward", "RouterStats", "Routing",
           "load_balancing_loss", "local_stats", "recorded_routing", "route", "routing_histogram", "summed_over"]
