"""`elevator bench`: grain-elevator next to local Grain, the wire's limit and
tf.data service, measured side by side in one run."""
