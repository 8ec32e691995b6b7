"""Reports: tables and plots of run results, rendered to terminal, markdown, HTML, CSV, JSON."""
