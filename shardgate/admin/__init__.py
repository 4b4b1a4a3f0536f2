"""Administration: the admin HTTP API and dashboard (`admin_http`, `dashboard/`), Prometheus
metrics (`metrics`) and the traffic history behind the dashboard's chart (`history`)."""
