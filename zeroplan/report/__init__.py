"""Rendering only: tables, markdown, CSV, JSON documents and plots of results computed elsewhere."""
