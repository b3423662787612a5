"""normspec.reports: the self-contained HTML report, built from results JSON only."""
