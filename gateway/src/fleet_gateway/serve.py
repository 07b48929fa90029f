"""Granian's entry point: it imports `app` here in each gateway worker process."""

from fleet_gateway.app import create_app
from fleet_gateway.litestar_compat import with_direct_send
from fleet_shared.config import load_settings
from fleet_shared.logging import configure_logging
from fleet_shared.tracing import configure_tracing

settings = load_settings(lm_credentials=False)
configure_logging(settings.profile.observability, process="gateway")
configure_tracing("gateway")  # here, in each serving process: an exporter thread does not survive a fork
app = with_direct_send(create_app(settings))  # a Turn stream's chunks skip Litestar's send wrappers
