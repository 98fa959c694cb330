"""remp controller: plans and drives switches; topology state machine in Redis (issue 4)."""
