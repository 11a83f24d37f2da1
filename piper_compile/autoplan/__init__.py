"""``piper.autoplan``: the best strategy for a model, a world and a memory budget, found by planning and
simulating every strategy piper can build (``space.py``), with stages balanced by FLOPs (``stages.py``)."""
from piper_compile.autoplan.search import NETWORKS, AutoPlan, Choice, autoplan, network_cost
from piper_compile.autoplan.profile import Profile, measure_link, profile
from piper_compile.autoplan.space import Candidate

__all__ = ["NETWORKS", "AutoPlan", "Candidate", "Choice", "Profile", "autoplan", "measure_link", "network_cost", "profile"]
