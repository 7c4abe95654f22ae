"""dspark.plugins"""
