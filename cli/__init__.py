"""The command line (python -m pixart_lowvram, pixart-lowvram): its entry point, commands, API client and
the random test models. Over core/; neither core/ nor nodes/ imports it."""
