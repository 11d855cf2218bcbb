"""`leadtime route`: an OpenAI-compatible gateway that routes live traffic with the router plugin."""
