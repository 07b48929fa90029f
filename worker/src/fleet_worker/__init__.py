"""fleet_worker."""

import os

# litellm (under dspy) fetches its model price list from the internet when it is imported, and
# waits through retries when it cannot: a worker uses the list litellm ships, so it never reaches
# out on its own and never stalls its first Turn on that fetch. An operator who wants the fetch
# sets the variable to anything else.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
