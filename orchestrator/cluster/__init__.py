"""The Ray cluster as kvtide uses it: nodes and NVLink domains, placement groups, placed
engines, the Serve pool layout and its supervisor."""
