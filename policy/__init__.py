"""remp policy service: traffic forecasting and automatic topology switching (issue 5)."""
