"""What the gateway says about itself: Prometheus metrics, the dashboard, the overload watch."""
